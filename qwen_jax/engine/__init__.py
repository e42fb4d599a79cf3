"""The serving engine: requests in, tokens out (`engine.Engine`); the contract is in `api`."""
