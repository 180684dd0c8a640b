package coldcopy

import "unsafe"

// SSE2, which every amd64 CPU has, provides MOVNTDQ.
const haveCold = true

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// coldBody copies len(dst) bytes, a multiple of 64, to a 64-byte aligned dst with non-temporal stores
// and fences them.
func coldBody(dst, src []byte) {
	if len(dst) > 0 {
		copyNT(unsafe.SliceData(dst), unsafe.SliceData(src), uintptr(len(dst)))
	}
}

//go:noescape
func copyNT(dst, src *byte, n uintptr)
