"""Helpers the tests share: real daemons, servers and engines started as the product starts them, and what the
tests read back. No test imports another test module; what two of them need lives here."""
