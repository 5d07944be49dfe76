"""Loading Hugging Face Gemma 4 checkpoints, shared by the recorder and the replayer.

`model` holds the model folder resolution (the embedded tiny checkpoint by default), dtype
and device checks, the processor, the config hash and the provenance a trace records; `sites`
is the one table of where HF computes each canonical kind (the recorder's hooks and
litert-convert's wrapper read it).
Nothing here imports torch or transformers until a model is loaded.
"""

import logging

# transformers imports torchao whenever it is installed (the `quant` extra): its notices about
# CUDA-only kernels it cannot load and torch's pytree deprecations would print on every model
# load, and say nothing about this tool's work
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
