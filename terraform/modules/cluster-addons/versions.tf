terraform {
  required_providers {
    helm = {
      source = "hashicorp/helm"
    }
  }
}
