"""GPU side of the registry: Mamba state slots and the eviction listener (torch).

Imports ``registry``; ``registry`` never imports this package.
"""
