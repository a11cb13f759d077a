"""Helpers the tests share: servers, model folders, configs, clients. No test imports another test file."""
