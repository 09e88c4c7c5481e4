//! PyTorch `torch.distributed.pipelining` CSV (placeholder, being written).
