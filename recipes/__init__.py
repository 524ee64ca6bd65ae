"""The tested cookbook of PyTorch distributed training. ``python -m recipes`` lists the recipes."""
