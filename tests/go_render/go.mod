module longrl/gorender

go 1.19
