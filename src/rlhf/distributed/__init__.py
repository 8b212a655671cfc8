"""Placement over Ray, training strategies (DDP, FSDP2, DeepSpeed), and the driver-side handles of remote roles."""
