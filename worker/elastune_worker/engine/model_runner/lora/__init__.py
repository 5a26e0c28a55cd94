"""Multi-LoRA serving: adapters of different ranks in one batch over one copy of the base weights.

``weights`` reads a PEFT ``save_pretrained`` directory into host tensors and checks it against the base
model; ``slots`` holds the device tier (max adapters at once, LRU, never evicting one that running
requests use) and the host tier (max CPU adapters, LRU); ``kernels`` computes a batch's LoRA deltas with
one of two kernels — padded to the batch's max rank (Punica's BGMV for decodes, segmented for prefill
chunks: cost ∝ tokens × max rank) or unpadded per adapter (S-LoRA's MBGMV: cost ∝ Σ ranks).
"""
