output "release" {
  description = "Name and version of the KEDA release; depending on it orders ScaledObjects after KEDA's CRDs."
  value       = "${helm_release.keda.name}-${helm_release.keda.version}"
}
