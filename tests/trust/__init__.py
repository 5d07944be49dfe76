"""Trust: every input the tool reads is untrusted (docs/robustness.md, "Threat model"), one file
per input: traces, GGUF files, import maps and dumps, tolerances files, prompts, caches, the
confinement of native engines' children, and the rest (test_other.py)."""
