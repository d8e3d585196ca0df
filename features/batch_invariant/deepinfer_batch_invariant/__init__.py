"""Batch-invariant mode: a request's logits and samples do not depend on its batch mates."""
