"""`--runtime llama.cpp[:TYPE]`: the runtime (runtime.py), its engine in the child process
(engine.py), and the GGUF files it runs: written (gguf_writer.py), read and checked
(gguf_reader.py), mixed per unit for precision recipes (gguf_mixed.py)."""
