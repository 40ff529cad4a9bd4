"""Generated from protos/peerd/v1 by `make proto`; do not edit."""
