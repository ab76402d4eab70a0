"""The worker: the physical KV tensors, the per-step tensor building, and sampling."""
