"""What the x86-64 CPU kernels share: this CPU as their libraries read it
(:mod:`~fa_jax.kernels.x86.cpu`), MLAS's GEMM, exp and softmax, which ONNX
Runtime and OpenVINO both call (:mod:`~fa_jax.kernels.x86.mlas`), AMX's BF16 tile
dot (:mod:`~fa_jax.kernels.x86.tile_dot`: PyTorch's and OpenVINO's GEMMs) and
glibc's ``tanhf`` (:mod:`~fa_jax.kernels.x86.glibc_tanhf`: ggml's and ONNX
Runtime's softcap)."""
