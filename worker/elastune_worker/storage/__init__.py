"""Artifact storage the worker reads and writes itself (s3://); volumes (pvc://, paths) need no code here."""
