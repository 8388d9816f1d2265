"""Compute kernels: a torch reference per operation and one dispatch function each."""
