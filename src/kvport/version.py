"""kvport's version: a module of its own, so the engine (which writes it into trace headers) and
the package face both import it without the engine importing the package face."""

__version__ = "0.1.0"
