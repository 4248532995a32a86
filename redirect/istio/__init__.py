"""Istio compatibility: ``istio-iptables`` flags (``flags``), pod annotations
(``annotations``) and the ``--run-validation`` probe (``validation``)."""
