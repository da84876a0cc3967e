"""Hugging Face safetensors ⇄ jaxseek checkpoints.

  mapping.py     THE table: HF tensor name ⇄ jaxseek parameter path, with a transform each
  hf.py          HF folders: config.json ⇄ ModelConfig, safetensors read and written one tensor at a time
  fp8.py         dequantisation of FP8 (e4m3) weights with 128×128 block scales
  pretrained.py  load_pretrained, the jaxseek checkpoint layout (config.yaml + Orbax), export to HF

Command line: scripts/convert_checkpoint.py (to-jaxseek, to-hf, inspect).
"""
