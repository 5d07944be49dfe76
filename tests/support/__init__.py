"""What the tests share, none of it a test: `cli` (the CLI run in-process and the one check of a
refusal), builders of inputs (`tiny_models`, `synth`, `diff_fixtures`), runtime plug-ins the
tests name in `--runtime tests.support.MODULE:FACTORY` (`bug_zoo`, `quant_bugs`, `crashy_runtime`,
`hostile_plugins`, `plugin_runtime`, `dump_fixture`), child engines (`confine_engine`,
`stream_engine`) and the docs' command server (`docs_trace_server`). Importing the package
imports none of them."""
