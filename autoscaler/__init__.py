"""lifl's Kubernetes operator: the autoscaler of Knative PodAutoscalers of lifl's class (``handlers``)."""
