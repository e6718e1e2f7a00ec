// The HTTP/2 conformance suite the tests run against the gateway's gRPC port
// (tests/test_h2spec.py), pinned; scripts/h2spec/build.sh builds it into .venv/bin.
// v2.2.1 is the newest h2spec release the Go module proxy serves (later tags carry a
// go.mod without /v2 and cannot be resolved as modules); the dependencies are pinned
// to the revisions h2spec itself pins.
module lifl.invalid/scripts/h2spec

go 1.18

require github.com/summerwind/h2spec v2.2.1+incompatible

require (
	github.com/fatih/color v0.0.0-20161025120501-bf82308e8c85 // indirect
	github.com/inconshreveable/mousetrap v1.0.0 // indirect
	github.com/mattn/go-colorable v0.1.0 // indirect
	github.com/mattn/go-isatty v0.0.4 // indirect
	github.com/spf13/cobra v0.0.0-20170118185516-dc208f4211e7 // indirect
	github.com/spf13/pflag v1.0.3 // indirect
	golang.org/x/net v0.0.0-20161104230106-55a3084c9119 // indirect
	golang.org/x/sys v0.0.0-20190209173611-3b5209105503 // indirect
)
