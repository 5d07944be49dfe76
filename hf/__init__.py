"""Loading Hugging Face Gemma 4 checkpoints, shared by the recorder and the replayer.

`model` holds the model folder resolution (the embedded tiny checkpoint by default), dtype
and device checks, the processor, the config hash and the provenance a trace records.
Nothing here imports torch or transformers until a model is loaded.
"""
