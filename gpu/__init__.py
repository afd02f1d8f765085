"""kvfill.gpu: the GPU run, whole - what a lent GPU machine runs and nothing else.

``bash gpu/device_check.sh`` (docs/gpu.md): the suite on CUDA, then
``gpu_check.py``'s sections and timings, then one summary.  The machine has
torch and Triton but neither vLLM nor kvfill installed: ``device_env.sh``
puts this checkout on its path.  ``ptx_check.py`` compiles the kernels for
sm_90 without a GPU.  The files import each other as ``kvfill.gpu.*`` and the
benchmarks' helpers as ``kvfill.bench.*``.
"""
