"""Which checkpoint to keep: a deterministic validation loss on held-out images, the DreamBooth paper's
fidelity scores (DINO, CLIP-I, CLIP-T), a ControlNet's agreement with its control images, the scoring
done at a trainer's validation points, and ``dreamstep eval`` over saved LoRAs and checkpoints."""
