"""The GPU acceptance harness: device scripts run on GPU machines, their recorded results in results/."""
