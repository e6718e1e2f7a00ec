//go:build tools

// Package tools pins the h2spec command as a dependency of this module.
package tools

import _ "github.com/summerwind/h2spec/cmd/h2spec"
