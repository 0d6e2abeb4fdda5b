"""Training, with no network: the model, token batches, the inner AdamW loop and the pure outer step."""
