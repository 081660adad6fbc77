"""How schedules leave the program: text and image timelines, and PyTorch's pipelining CSV
format (import and export). Imports only model/."""
