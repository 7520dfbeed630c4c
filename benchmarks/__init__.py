"""Side-by-side benchmarks of ddptrain against a raw PyTorch loop (`make bench`); see run.py."""
