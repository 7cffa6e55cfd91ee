"""Hugging Face conversion: config.json and safetensors directories to and from jmoe model
checkpoints (jmoe/checkpoint/), one part of one variable at a time. convert.py is the logic of
`python -m jmoe.convert import-hf / export-hf`; families.py, fields.py and common.py translate
config.json; mappings.py maps tensors onto parameters; files.py reads and writes safetensors."""
