# Sourced by gpu/device_check.sh, and by tests/test_device_image.py to stand
# in for the device image: how kvfill goes on the path of a machine where it is
# not installed (torch and triton only, no vLLM, nothing installed by us).
#
#   kvfill_device_env SITE   builds the namespace package kvfill/ in the empty
#                            folder SITE, one link per package of setup.cfg's
#                            package_dir (kvfill.kernels = kernels, ...), and puts
#                            SITE first on PYTHONPATH.
# Reading setup.cfg means a package added there is on the device's path too.
kvfill_device_env() {
  local site=$1 root pkgs=0 pkg dir
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  mkdir -p "$site/kvfill" || return 1
  while read -r pkg dir; do
    [ -d "$root/$dir" ] || { echo "device_env: setup.cfg maps $pkg to $dir, which is not a folder of $root" >&2; return 1; }
    ln -s "$root/$dir" "$site/kvfill/${pkg#kvfill.}" || return 1
    pkgs=$((pkgs + 1))
  done < <(sed -n 's/^[[:space:]]*\(kvfill\.[A-Za-z_][A-Za-z0-9_]*\)[[:space:]]*=[[:space:]]*\([A-Za-z_][A-Za-z0-9_]*\)[[:space:]]*$/\1 \2/p' \
             "$root/setup.cfg")
  if [ "$pkgs" -eq 0 ]; then
    echo "device_env: no 'kvfill.NAME = folder' line in $root/setup.cfg's package_dir" >&2
    return 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}
