"""gpu_impl: implementations of the contract on CUDA tensors (cuDNN-backed) and a portable
torch backend. Importing this package never needs cuDNN."""
