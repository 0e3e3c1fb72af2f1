"""Small runtime pieces the operator and the data plane's deployables share."""
