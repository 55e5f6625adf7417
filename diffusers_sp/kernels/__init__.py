"""Local attention kernels run by each rank: SDPA (cuDNN / flash / efficient), flash-attn, VSA."""
