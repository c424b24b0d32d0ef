"""Names that a command's parser offers and the library behind it checks, kept here, torch-free, so that
``--help`` and a bad value answer before torch or diffusers are imported."""

TINY_SDXL_SINGLE_FILE = "tiny_sdxl.safetensors"
LORA_LAYOUTS = ("kohya", "diffusers", "mindspore")
DTYPE_NAMES = ("fp32", "fp16", "bf16")
# Which weights of a checkpoint-N folder kept with an EMA to read (dreamstep.evaluation.candidates).
CHECKPOINT_WEIGHTS = ("auto", "ema", "raw")
CHECKPOINT_WEIGHTS_HELP = ("for checkpoint-N folders (and a ControlNet run's folder) of a run trained with "
                           "--ema_decay: its EMA or its raw weights (auto: the EMA when the run validated with it)")

# sd-scripts' loss and flow-matching options (dreamstep.diffusion holds their math).
LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")
TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
