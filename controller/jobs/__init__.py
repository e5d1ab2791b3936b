"""Jobs as the service layer takes them: quote, submit, cancel; the state machine at work; and
the spec-to-request functions the control loop shares with submission."""
