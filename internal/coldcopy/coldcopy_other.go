//go:build !amd64

package coldcopy

// Elsewhere Copy is the built-in copy: Go's assembler has no portable non-temporal store.
const haveCold = false

func uintptrOf([]byte) uintptr { return 0 }

func coldBody(dst, src []byte) { copy(dst, src) }
