# KEDA from its Helm chart: the operator that turns ScaledObjects into HPAs and scales them to and
# from zero, and its metrics server, which serves the stream lag to the HPAs.

resource "helm_release" "keda" {
  name             = "keda"
  namespace        = var.namespace
  create_namespace = true
  repository       = "https://kedacore.github.io/charts"
  chart            = "keda"
  version          = var.chart_version
  wait             = true

  values = [yamlencode({
    podSecurityContext = {
      operator     = { runAsNonRoot = true, seccompProfile = { type = "RuntimeDefault" } }
      metricServer = { runAsNonRoot = true, seccompProfile = { type = "RuntimeDefault" } }
      webhooks     = { runAsNonRoot = true, seccompProfile = { type = "RuntimeDefault" } }
    }
    resources = {
      operator     = { requests = { cpu = "100m", memory = "128Mi" }, limits = { cpu = "1", memory = "1Gi" } }
      metricServer = { requests = { cpu = "100m", memory = "128Mi" }, limits = { cpu = "1", memory = "1Gi" } }
    }
  })]
}
