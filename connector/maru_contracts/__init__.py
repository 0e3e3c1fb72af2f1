"""What the operator and the data plane's deployables agree on."""
