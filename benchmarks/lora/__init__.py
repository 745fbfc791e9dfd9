"""The parts of ``python -m benchmarks.bench_lora`` (its docstring says what each measures and how): ``params``
(exact counts on the meta device), ``memory`` (one DPO or GRPO step's peak in a fresh process) and ``heldout`` (LoRA
SFT vs full SFT on the demo's held-out prompts). ``bench_lora`` parses the command line and writes the results."""
