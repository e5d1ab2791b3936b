"""Who may do what: API keys, tenants' grants, and what tenants may see of the control plane."""
