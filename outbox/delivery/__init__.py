"""Delivery: the dispatcher, its claim/attempt/finish persistence, ordering groups, the retry schedule and policy, and the LISTEN wake-up."""
