"""Distillation healing (teacher -> student logit KL). Planned; no method is registered yet."""
