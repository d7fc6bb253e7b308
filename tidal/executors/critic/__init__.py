"""The critic: PPO's learned value function, on its own ranks with its own layout (tidal/executors/critic/executor.py)."""
