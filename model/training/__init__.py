"""Training the paper's Transformer here: the trainer (`python -m model.training.train`) and the
corpus it reads by default (`python -m model.training.corpus`).
"""
