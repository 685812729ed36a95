"""What runs a plan on the device: the model runner, its input arrays and staging, the KV page tensors and the
sampler."""
