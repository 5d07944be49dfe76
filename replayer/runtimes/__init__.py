"""The built-in runtimes: one module (or folder) per engine adapter, and registry.py, the table of
what each runtime is, needs and can do (docs/design.md, "The runtimes wing")."""
