"""The layer and GPT inside other libraries: huggingface (transformers' attention interface),
parallel (torch.distributed), torch_export and onnx_export.

Nothing is re-exported here, so that each module is imported only by whoever needs it: they pull
in heavy peers (transformers, torch.distributed, onnxscript), and parallel registers DTensor
sharding rules when it is imported."""
