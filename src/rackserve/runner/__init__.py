"""The model runner: input building, the forward pass, sampling and stop checks."""
