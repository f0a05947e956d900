"""The benchmarks: kernel (the layer against torch's), hf (transformers' GPT-2), gpt2 (generation),
deploy (export, AOTInductor, ONNX), and report (rows, tables, plots and the timing they share)."""
