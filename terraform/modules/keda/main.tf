# KEDA from its Helm chart: the operator that turns ScaledObjects into HPAs and scales them to and
# from zero, and its metrics server, which serves the stream lag to the HPAs.

locals {
  # The Kubernetes versions each KEDA minor release is tested on (keda.sh/docs/2.20/operate/cluster,
  # "Kubernetes Compatibility"). A pair outside this table is refused at plan time.
  tested_kubernetes = {
    "2.17" = ["1.30", "1.31", "1.32"]
    "2.18" = ["1.31", "1.32", "1.33"]
    "2.19" = ["1.32", "1.33", "1.34"]
    "2.20" = ["1.33", "1.34", "1.35"]
  }
  keda_minor = join(".", slice(split(".", var.chart_version), 0, 2))
}

resource "helm_release" "keda" {
  name             = "keda"
  namespace        = var.namespace
  create_namespace = true
  repository       = "https://kedacore.github.io/charts"
  chart            = "keda"
  version          = var.chart_version
  wait             = true

  lifecycle {
    precondition {
      condition     = contains(lookup(local.tested_kubernetes, local.keda_minor, []), var.kubernetes_version)
      error_message = "KEDA ${var.chart_version} is not tested on Kubernetes ${var.kubernetes_version}: pick a pair from local.tested_kubernetes in modules/keda."
    }
  }

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
