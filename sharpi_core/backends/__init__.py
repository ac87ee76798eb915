"""Optional accelerator backends (`cuda`: CuPy + the kernels in the repository's cuda/ directory)."""
